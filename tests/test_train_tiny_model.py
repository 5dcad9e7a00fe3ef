"""The pieces of `scripts/train_tiny_model.py` that decide what the bundled model learns: where a
training window starts, how a verse document is cut, and the self-distillation target."""

import importlib.util
import random
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_tiny_model", REPO / "scripts" / "train_tiny_model.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

BOS, EOS = 0, 1


def test_every_window_starts_at_a_documents_bos():
    stream = torch.tensor([BOS, 5, 6, EOS, BOS, 7, EOS, BOS, 8, 9, 9, EOS, BOS, 4, EOS])
    batch = script.sample_batch(stream, 64, 4, BOS, torch.Generator().manual_seed(0))
    starts = {i for i, token in enumerate(stream.tolist()) if token == BOS and i + 4 <= len(stream)}
    seen = set()
    for window in batch:
        [start] = [s for s in starts if torch.equal(stream[s : s + 4], window)]
        seen.add(start)
    assert seen == starts  # every document start is drawn, and nothing else


def test_a_verse_document_runs_from_any_line_to_the_speechs_end():
    speech = "HAMLET:\n" + "\n".join(f"line {i}." for i in range(6))
    rng = random.Random(0)
    documents = {script.verse_from_a_random_line(speech, rng) for _ in range(200)}
    assert len(documents) == 6 - script.MIN_VERSE_LINES + 1
    for document in documents:
        assert document.endswith("line 5.\n") and "HAMLET" not in document
        assert document.count("\n") >= script.MIN_VERSE_LINES


def test_self_distillation_learns_the_teachers_words_and_the_documents_stops():
    """Teacher uniform over 5 tokens (so P(EOS) = 0.2 everywhere); batch `<s> 3 4 </s>`:
    where the document goes on the target is uniform over the other 4 tokens, where it
    ends the target is EOS; the continuing positions are corrections (teacher EOS > 0.1)."""
    batch = torch.tensor([[BOS, 3, 4, EOS]])
    teacher = lambda input_ids: SimpleNamespace(logits=torch.zeros(1, 4, 5))  # noqa: E731
    student_logits = torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(0))
    student = lambda input_ids: SimpleNamespace(logits=student_logits)  # noqa: E731
    log_q = F.log_softmax(student_logits[0, :3], dim=-1)
    go_on = torch.tensor([0.25, 0.0, 0.25, 0.25, 0.25])
    ce = torch.stack([-(go_on * log_q[0]).sum(), -(go_on * log_q[1]).sum(), -log_q[2, EOS]])
    plain = script.self_distillation_loss(student, teacher, batch, BOS, EOS)
    weighted = script.self_distillation_loss(student, teacher, batch, BOS, EOS, correction_weight=5.0)
    torch.testing.assert_close(plain, ce.mean())
    torch.testing.assert_close(weighted, (5 * ce[0] + 5 * ce[1] + ce[2]) / 11)


def test_a_repeated_ngram_marks_its_words_from_the_continuation_on():
    """`start` = 2: the prefix `5 6` is never marked; `5 6 7` written twice marks its second
    copy, except the comma-like token 9, which is not a word."""
    tokens = [5, 6, 7, 5, 6, 9, 5, 6, 7, 5, 6, 9]
    mask = script.repeated_ngram_mask(tokens, start=2, words={5, 6, 7}, n=3)
    assert mask == [False] * 6 + [True, True, True, True, True, False]
    assert not any(script.repeated_ngram_mask([5, 6, 7, 8, 5, 6], start=0, words={5, 6, 7, 8}, n=3))


def test_the_loop_correction_moves_a_repeated_words_share_to_other_words_not_to_eos():
    """Teacher over 4 tokens [EOS 0.1, 2: 0.3, 3: 0.4, 4: 0.2] everywhere; text `<s> 3 3 4`
    with the second 3 repeated: there the target is [0.1, 0.3 * 1.8, 0, 0.2 * 1.8] (EOS keeps
    0.1, the other words share the 0.9 left), elsewhere the teacher's; positions before the continuation do not count."""
    probs = torch.tensor([0.0, 0.1, 0.3, 0.4, 0.2])
    teacher = lambda input_ids: SimpleNamespace(logits=probs.clamp(min=1e-30).log().expand(1, 4, 5))  # noqa: E731
    student_logits = torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(0))
    student = lambda input_ids: SimpleNamespace(logits=student_logits)  # noqa: E731
    text = torch.tensor([[BOS, 3, 3, 4]])
    repeated = torch.tensor([[False, False, True, False]])
    written = torch.tensor([[False, True, True, True]])
    log_q = F.log_softmax(student_logits[0, :3], dim=-1)
    corrected = torch.tensor([0.0, 0.1, 0.54, 0.0, 0.36])
    ce = torch.stack([-(probs * log_q[0]).sum(), -(corrected * log_q[1]).sum(), -(probs * log_q[2]).sum()])
    loss = script.loop_correction_loss(student, teacher, text, repeated, written, EOS, weight=4.0)
    torch.testing.assert_close(loss, (ce[0] + 4 * ce[1] + ce[2]) / 6)


def test_min_spoken_lines_leaves_out_the_speeches_that_end_after_one_line():
    speeches = ["ROMEO:\nBut soft!", "JULIET:\nAy me!\nShe speaks.", "HAMLET:\nOne.\nTwo.\nThree."]
    for forms in ("inline", "mixed"):
        every = script.speech_documents(speeches, forms, seed=0)
        kept = script.speech_documents(speeches, forms, seed=0, min_spoken_lines=2)
        assert len(every) == 3 and len(kept) == 2
        assert not any("But soft!" in document for document in kept)


def test_the_loop_correction_without_eos_teaches_words_only():
    """Same teacher and text as above, `teach_eos=False`: EOS leaves the target and the
    student's softmax, so the loss is the cross-entropy over the words and EOS gets no gradient."""
    probs = torch.tensor([0.0, 0.1, 0.3, 0.4, 0.2])
    teacher = lambda input_ids: SimpleNamespace(logits=probs.clamp(min=1e-30).log().expand(1, 4, 5))  # noqa: E731
    student_logits = torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    student = lambda input_ids: SimpleNamespace(logits=student_logits)  # noqa: E731
    text = torch.tensor([[BOS, 3, 3, 4]])
    repeated = torch.tensor([[False, False, True, False]])
    written = torch.tensor([[False, True, True, True]])
    words = [0, 2, 3, 4]  # every token but EOS
    log_q = F.log_softmax(student_logits[0, :3, words], dim=-1)
    teacher_words = torch.tensor([0.0, 0.3, 0.4, 0.2]) / 0.9
    corrected = torch.tensor([0.0, 0.6, 0.0, 0.4])  # the repeated 3 removed, the rest renormalised
    ce = torch.stack([-(teacher_words * log_q[0]).sum(), -(corrected * log_q[1]).sum(),
                      -(teacher_words * log_q[2]).sum()])
    loss = script.loop_correction_loss(student, teacher, text, repeated, written, EOS, weight=4.0, teach_eos=False)
    torch.testing.assert_close(loss, (ce[0] + 4 * ce[1] + ce[2]) / 6)
    loss.backward()
    assert student_logits.grad[..., EOS].abs().max() < 1e-6 < student_logits.grad.abs().max()
