// A click on a notebook figure toggles it between the page's width and its own pixel size
// (JupyterLab's own class for an unconfined image; the output scrolls sideways).
document.addEventListener("click", (event) => {
  const img = event.target.closest(".jupyter-wrapper .jp-RenderedImage img");
  if (img) img.classList.toggle("jp-mod-unconfined");
});

// A stepper over the key frames a notebook saved (hooks/site.py): one picture at a time, chosen
// by the range input or the two buttons. Without this script the saved frame stays visible.
function setupStepper(box) {
  const frames = [...box.querySelectorAll(":scope > img")];
  const controls = box.querySelector(".mv-stepper-controls");
  const range = controls.querySelector("input");
  const label = controls.querySelector(".mv-stepper-label");
  const show = (k) => {
    const i = Math.max(0, Math.min(frames.length - 1, k));
    frames.forEach((frame, j) => { frame.hidden = j !== i; });
    range.value = String(i);
    label.textContent = frames[i].dataset.label;
  };
  range.addEventListener("input", () => show(Number(range.value)));
  controls.querySelectorAll("button").forEach((button) =>
    button.addEventListener("click", () => show(Number(range.value) + Number(button.dataset.step))));
  controls.hidden = false;
}

function setupSteppers() { document.querySelectorAll(".mv-stepper").forEach(setupStepper); }
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setupSteppers);
else setupSteppers();
