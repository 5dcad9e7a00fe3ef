// A click on a notebook figure toggles it between the page's width and its own pixel size
// (JupyterLab's own class for an unconfined image; the output scrolls sideways).
document.addEventListener("click", (event) => {
  const img = event.target.closest(".jupyter-wrapper .jp-RenderedImage img");
  if (img) img.classList.toggle("jp-mod-unconfined");
});
