"""Train the bundled `tiny-shakespeare` model: a byte-level BPE tokenizer and a small Llama.

The result is a genuine Hugging Face checkpoint (config.json, model.safetensors,
generation_config.json, tokenizer files) that ships inside the package, so minivllm runs
offline on a fresh machine. The recipe is nanoGPT's Shakespeare run with Llama's pieces:

1. Split the corpus into speeches (its blank-line-separated blocks, each a speaker line and
   the lines spoken); the first 90 % train, the last 10 % are held out for validation.
2. Write each speech as one training document in one of the layouts a prompt comes in
   (`PROMPT_FORMS`: `<s>ROMEO:\nlines\n</s>`, `<s>ROMEO: lines\n</s>`, or the lines alone), so
   the model continues each; EOS ends the speech, so generation stops by itself.
3. Train a byte-level BPE tokenizer (vocab 4096, `<s>` `</s>` `<pad>`) on the training split.
4. Train `LlamaForCausalLM` (~5M parameters, grouped-query attention) on random 512-token
   windows of the documents laid end to end, each window starting at a document's BOS; keep
   the best-validation weights.

`--init-from DIR` skips step 3 and starts from a checkpoint's weights and tokenizer (fine-tuning);
with `--self-distill` that checkpoint is also the teacher (see `self_distillation_loss`).
`--distill-from DIR --size draft` trains a draft model for speculative decoding: DIR's
tokenizer (a draft must share the target's vocabulary), fresh weights of the `draft` size,
and the target's next-token distributions as soft labels (knowledge distillation: the loss is
the cross-entropy to the target's softmax, so the draft learns to guess what the target would
say, which is what the acceptance rate rewards). The bundled draft model was made with

    python scripts/train_tiny_model.py --corpus ../shared/data/tinyshakespeare.txt \\
        --distill-from minivllm/bundled_models/tiny-shakespeare --size draft \\
        --out minivllm/bundled_models/tiny-shakespeare-draft --device cuda --steps 900 --batch-size 8 \\
        --block-size 256 --lr 2e-3 --min-lr 2e-4 --warmup-steps 30 --dropout 0.0 --eval-interval 100 \\
        --max-eval-windows 32

(its model card gives the losses and the acceptance rate against tiny-shakespeare).

The bundled model was made in six runs (its model card gives each exactly): a from-scratch
run on one GPU on the corpus as plain text (commit 9bac8cd's script), a CPU fine-tune on the
speech documents in the inline layout (`--forms inline`), a GPU fine-tune over the mixed
layouts of step 2, a GPU self-distillation that keeps the words and moves the ends of
speeches, the same with loop correction (`loop_correction_loss`), then the same on the speeches
of two lines or more with a loop correction that teaches words only:

    python scripts/train_tiny_model.py --corpus ../shared/data/tinyshakespeare.txt \\
        --init-from <run 3's checkpoint> --self-distill --correction-weight 5 --out /tmp/tiny-verse \\
        --device cuda --steps 2400 --batch-size 16 --block-size 256 --lr 3e-4 --min-lr 3e-5 \\
        --warmup-steps 20 --dropout 0.1 --eval-interval 200 \\
        --form-weights corpus=0.35,inline=0.2,verse=0.45 --select last
    python scripts/train_tiny_model.py --corpus ../shared/data/tinyshakespeare.txt \\
        --init-from /tmp/tiny-verse --self-distill --correction-weight 5 \\
        --loop-correction-every 2 --loop-weight 30 --out /tmp/tiny-loops \\
        --device cuda --steps 1200 --batch-size 16 --block-size 256 --lr 3e-4 --min-lr 3e-5 \\
        --warmup-steps 20 --dropout 0.1 --eval-interval 400 \\
        --form-weights corpus=0.35,inline=0.2,verse=0.45 --select last
    python scripts/train_tiny_model.py --corpus ../shared/data/tinyshakespeare.txt \\
        --init-from /tmp/tiny-loops --self-distill --correction-weight 5 \\
        --loop-correction-every 2 --loop-weight 30 --loop-without-eos --min-spoken-lines 2 \\
        --out /tmp/tiny-first-line --device cuda --steps 1150 --max-minutes 7.6 --batch-size 16 \\
        --block-size 256 --lr 3e-4 --min-lr 3e-5 --warmup-steps 20 --dropout 0.1 \\
        --eval-interval 400 --form-weights corpus=0.35,inline=0.2,verse=0.45 --select last

The corpus is only ~300k tokens, so a from-scratch run memorises it after ~40 epochs (step
~400 at the default batch): validation loss bottoms out there and climbs after. Keeping the
best-validation weights is the early stopping that makes the result generalise.

Smoke test on a CPU (a few steps, seconds):

    python scripts/train_tiny_model.py --corpus ../shared/data/tinyshakespeare.txt \\
        --device cpu --steps 4 --batch-size 2 --eval-interval 2 --max-eval-windows 4 --out /tmp/tiny
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import time
import urllib.request
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
VAL_FRACTION = 0.1
VOCAB_SIZE = 4096
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2: the trainer adds them first, in this order
MODEL_MAX_LENGTH = 1024  # max_position_embeddings: RoPE works past the 512 we train on
# Model shapes for --size. head_dim is 32 in both (hidden_size / num_heads).
SIZES = {
    "bundled": {"hidden_size": 256, "intermediate_size": 640, "num_layers": 6, "num_heads": 8, "num_kv_heads": 2},
    "draft": {"hidden_size": 128, "intermediate_size": 320, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
}

# The layouts of a speech a learner types as a prompt, with their share of the training documents.
PROMPT_FORMS = {"corpus": 0.5, "inline": 0.3, "verse": 0.2}
# A verse document needs a few lines, so that one line typed as a prompt is continued. An inline
# one needs two: `<s>ROMEO: line\n</s>` would read as a lone line of verse followed by EOS.
MIN_VERSE_LINES = 3
MIN_INLINE_LINES = 2

# Each message renders as a speech in the corpus's layout ("<s>ROMEO:\n<lines>\n</s>"), so a
# chat prompt looks like a scene, the model answers in character and ends its answer with EOS.
# The template writes BOS and EOS itself because apply_chat_template tokenizes with
# add_special_tokens=False.

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token }}{{ message['role'] | upper }}:\n{{ message['content'] }}\n{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}ASSISTANT:\n{% endif %}"
)


def parse_form_weights(text: str) -> dict[str, float]:
    weights = {name: float(share) for name, _, share in (item.partition("=") for item in text.split(","))}
    if set(weights) - set(PROMPT_FORMS) or min(weights.values()) < 0:
        raise argparse.ArgumentTypeError(f"layouts are {sorted(PROMPT_FORMS)}, shares >= 0: {text!r}")
    return weights


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="plain-text corpus (tinyshakespeare)")
    p.add_argument("--download", action="store_true", help="fetch the corpus if --corpus is missing")
    p.add_argument("--out", type=Path, required=True, help="folder for the checkpoint")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this checkpoint's weights and tokenizer (fine-tune)")
    p.add_argument("--self-distill", action="store_true",
                   help="with --init-from: learn its next-token distributions, ending speeches where the documents do")
    p.add_argument("--correction-weight", type=float, default=1.0,
                   help="--self-distill: weight of the positions where the start would end a speech that goes on")
    p.add_argument("--loop-correction-every", type=int, default=0,
                   help="--self-distill: every N steps also correct the loops of the model's own greedy text (0: never)")
    p.add_argument("--loop-weight", type=float, default=5.0,
                   help="weight of a repeated word's position in the loop correction")
    p.add_argument("--min-spoken-lines", type=int, default=1,
                   help="leave out speeches with fewer lines (2: no document ends after its first line)")
    p.add_argument("--loop-without-eos", action="store_true",
                   help="the loop correction teaches words only, never where to stop")
    p.add_argument("--forms", choices=["inline", "mixed"], default="mixed",
                   help="how speeches are laid out: all inline, or mixed over PROMPT_FORMS")
    p.add_argument("--form-weights", type=parse_form_weights, default=PROMPT_FORMS,
                   help='shares of the layouts for --forms mixed, e.g. "corpus=0.45,inline=0.25,verse=0.3"')
    p.add_argument("--select", choices=["best", "last"], default="best",
                   help="keep the best-validation weights (early stopping) or the last")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--distill-from", type=Path, default=None,
                   help="train a draft model for this checkpoint: its tokenizer, its predictions as labels")
    # model (--size picks the defaults of the five shape flags below; an explicit flag wins)
    p.add_argument("--size", choices=sorted(SIZES), default="bundled",
                   help="bundled: tiny-shakespeare's shape; draft: a ~6x smaller speculative-decoding draft")
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument("--num-kv-heads", type=int)
    p.add_argument("--dropout", type=float, default=0.3,
                   help="residual dropout during training only (the saved model has none)")
    # optimisation
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=512, help="tokens per window, BOS included")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    # bookkeeping
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--log-interval", type=int, default=20)
    p.add_argument("--max-eval-windows", type=int, default=None, help="cap eval cost (smoke tests)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop early past this wall time")
    p.add_argument("--max-shard-size", default=None, help='e.g. "10MB"; default: one file')
    p.set_defaults(**SIZES[p.parse_known_args(argv)[0].size])
    args = p.parse_args(argv)
    if args.distill_from is not None and args.init_from is not None:
        raise ValueError("--distill-from trains fresh weights: it cannot be combined with --init-from.")
    if args.self_distill and args.init_from is None:
        raise ValueError("--self-distill learns from the --init-from checkpoint: pass --init-from.")
    if args.hidden_size % args.num_heads or args.num_heads % args.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads.")
    if args.loop_correction_every < 0 or args.loop_weight < 1:
        raise ValueError("--loop-correction-every must be >= 0 and --loop-weight >= 1.")
    if args.loop_correction_every and not args.self_distill:
        raise ValueError("--loop-correction-every needs --self-distill: its targets come from the teacher.")
    if args.steps < 1 or args.batch_size < 1 or args.block_size < 2:
        raise ValueError("steps and batch_size must be >= 1 and block_size >= 2.")
    return args


# ----------------------------------------------------------------------------- data

def load_corpus(path: Path, download: bool) -> str:
    if not path.exists():
        if not download:
            raise ValueError(f"corpus {path} not found (pass --download to fetch it).")
        path.parent.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(CORPUS_URL, path)
    return path.read_text(encoding="utf-8")


def split_speeches(text: str) -> list[str]:
    """The corpus's blank-line-separated blocks, each `SPEAKER:\nline\n...` (no trailing newline).

    A block with a speaker line and nothing spoken (the corpus has ~120) is dropped.
    """
    blocks = (block.strip("\n") for block in text.split("\n\n"))
    return [block for block in blocks if "\n" in block]


def speech_document(speech: str, form: str = "inline") -> str:
    """One speech as a training document (BOS/EOS added later), in one of `PROMPT_FORMS`:

        inline  `ROMEO: But soft!\nWhat light?\n`   the name and the first line share a line
        corpus  `ROMEO:\nBut soft!\nWhat light?\n`  the corpus's own layout
        verse   `But soft!\nWhat light?\n`          no speaker
    """
    speaker, _, lines = speech.partition("\n")
    if form not in PROMPT_FORMS:
        raise ValueError(f"form must be one of {sorted(PROMPT_FORMS)}, got {form!r}")
    return {"inline": f"{speaker} {lines}\n", "corpus": f"{speaker}\n{lines}\n", "verse": f"{lines}\n"}[form]


def speech_documents(speeches: list[str], forms: str, seed: int,
                     weights: dict[str, float] = PROMPT_FORMS, min_spoken_lines: int = 1) -> list[str]:
    """`--forms inline`: every speech inline; `mixed`: each speech's form drawn by `PROMPT_FORMS`'
    weights, so the model continues whichever of them a learner types (a verse document starts
    at a random line of its speech). Speeches of fewer than `min_spoken_lines` lines are left
    out: with 2, no document ends after its first line, so the model learns to go on after one."""
    speeches = [speech for speech in speeches if speech.count("\n") >= min_spoken_lines]
    if forms == "inline":
        return [speech_document(speech) for speech in speeches]
    rng = random.Random(seed)
    documents = []
    for speech in speeches:
        form = rng.choices(list(weights), list(weights.values()))[0]
        if form == "verse" and speech.count("\n") < MIN_VERSE_LINES:
            form = "corpus"
        if form == "inline" and speech.count("\n") < MIN_INLINE_LINES:
            form = "corpus"
        documents.append(verse_from_a_random_line(speech, rng) if form == "verse" else speech_document(speech, form))
    return documents


def verse_from_a_random_line(speech: str, rng: random.Random) -> str:
    """The lines alone, from a random line on (at least `MIN_VERSE_LINES` of them): whichever
    line a learner types, a sentence's last one too, starts a document that goes on after it."""
    lines = speech.split("\n")[1:]
    start = rng.randrange(len(lines) - MIN_VERSE_LINES + 1)
    return "\n".join(lines[start:]) + "\n"


def split_corpus(speeches: list[str], val_fraction: float = VAL_FRACTION) -> tuple[list[str], list[str]]:
    """Hold out the last `val_fraction` of the speeches (whole speeches, in corpus order)."""
    cut = int(len(speeches) * (1 - val_fraction))
    return speeches[:cut], speeches[cut:]


def train_tokenizer(train_text: str, vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style): every byte has a token, so any text round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([train_text], trainer=trainer)
    # Like Llama: every encoded text starts with BOS.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,  # decoding must give back the exact text
        chat_template=CHAT_TEMPLATE,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, documents: list[str]) -> torch.Tensor:
    """Every document as `<s> document </s>`, laid end to end in one token stream.

    BOS before each speech matches how a prompt is encoded (`<s>ROMEO:`); EOS after it is
    what teaches the model to stop. Special ids are added by id, never parsed from text.
    """
    encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream = [token for ids in encoded for token in (bos, *ids, eos)]
    return torch.tensor(stream, dtype=torch.long)


def sample_batch(tokens: torch.Tensor, batch_size: int, block_size: int, bos_id: int,
                 generator: torch.Generator) -> torch.Tensor:
    """Random windows of the stream, each starting at a document's BOS: [batch_size, block_size].

    A window cut mid-speech behind a BOS would teach that `<s>` + the speech's last line + `</s>`
    is a whole document, and the model would end a line of verse typed as a prompt at once.
    """
    starts = (tokens[: len(tokens) - block_size + 1] == bos_id).nonzero().squeeze(1)
    picks = starts[torch.randint(0, len(starts), (batch_size,), generator=generator)]
    return torch.stack([tokens[s : s + block_size] for s in picks.tolist()])


def fixed_windows(tokens: torch.Tensor, block_size: int, bos_id: int,
                  max_windows: int | None) -> torch.Tensor:
    """Consecutive non-overlapping windows, BOS first: [num_windows, block_size]."""
    span = block_size - 1
    num_windows = len(tokens) // span
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    windows = tokens[: num_windows * span].view(num_windows, span)
    return torch.cat([torch.full((num_windows, 1), bos_id), windows], dim=1)


# ----------------------------------------------------------------------------- model

def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,  # fewer K/V heads than query heads: GQA
        head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # the 4096x256 embedding is a fifth of the model; share it
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def load_or_build(args: argparse.Namespace, train_speeches: list[str]
                  ) -> tuple[PreTrainedTokenizerFast, LlamaForCausalLM]:
    """A fresh tokenizer and model, `--init-from`'s (with this script's chat template), or
    `--distill-from`'s tokenizer and a fresh model."""
    if args.distill_from is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.distill_from)
        tokenizer.chat_template = CHAT_TEMPLATE
        return tokenizer, build_model(args, tokenizer)
    if args.init_from is None:
        train_text = "".join(speech_documents(train_speeches, "inline", args.seed))
        tokenizer = train_tokenizer(train_text)
        return tokenizer, build_model(args, tokenizer)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init_from)
    tokenizer.chat_template = CHAT_TEMPLATE
    model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
    return tokenizer, model


def add_residual_dropout(model: LlamaForCausalLM, p: float) -> list:
    """GPT-2-style dropout on the embeddings and on each block's two residual branches.

    Llama has no such dropout (its pre-training data is huge); our corpus is ~300k tokens,
    so a 5M model overfits within a few epochs without it. Hooks keep the saved model stock.
    """
    def hook(module, inputs, output):
        return F.dropout(output, p=p, training=module.training)

    modules = [model.model.embed_tokens]
    for layer in model.model.layers:
        modules += [layer.self_attn.o_proj, layer.mlp.down_proj]
    return [m.register_forward_hook(hook) for m in modules] if p > 0 else []


def distillation_loss(model: LlamaForCausalLM, teacher: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy from the teacher's next-token distribution to the student's (KL divergence
    plus the teacher's entropy, a constant): the student learns the whole distribution."""
    with torch.no_grad():
        target = torch.softmax(teacher(input_ids=batch).logits.float(), dim=-1)
    log_q = torch.log_softmax(model(input_ids=batch).logits.float(), dim=-1)
    return -(target * log_q).sum(dim=-1).mean()


def self_distillation_loss(model: LlamaForCausalLM, teacher: LlamaForCausalLM, batch: torch.Tensor,
                           bos_id: int, eos_id: int, correction_weight: float = 1.0) -> torch.Tensor:
    """Distillation from the model's own starting point, where the documents decide the stops:

        next token is EOS or BOS   the target is that token (a document ends, the next begins)
        any other token            the teacher's distribution with EOS's share removed

    So the words stay what the teacher would say (its held-out quality is kept) while the
    end of a speech moves to where the documents put it. The corrections (the teacher gives EOS
    more than a tenth, the document goes on) are a few positions in a thousand; each counts
    `correction_weight` times.
    """
    next_tokens = batch[:, 1:]
    with torch.no_grad():
        target = torch.softmax(teacher(input_ids=batch).logits[:, :-1].float(), dim=-1)
        corrections = target[..., eos_id] > 0.1
        target[..., eos_id] = 0.0
        target /= target.sum(dim=-1, keepdim=True)
        boundary = (next_tokens == bos_id) | (next_tokens == eos_id)
        target[boundary] = F.one_hot(next_tokens[boundary], target.shape[-1]).float()
        weight = 1.0 + (correction_weight - 1.0) * (corrections & ~boundary).float()
    log_q = torch.log_softmax(model(input_ids=batch).logits[:, :-1].float(), dim=-1)
    return (-(target * log_q).sum(dim=-1) * weight).sum() / weight.sum()


# Loop correction: the model continues short prefixes greedily, and wherever it repeats a word
# of an n-gram it has already written, the target is the teacher's distribution without that
# word. A small model's greedy text falls into loops ("Romeo! Romeo! Romeo!") that no
# next-token target on real text ever shows it; this is sequence-level unlikelihood training
# (Welleck et al. 2019) with the teacher's own second choice in place of a bare push-down, so
# the words around a loop stay the teacher's. Only words are corrected: a line break or a comma
# repeats in any verse.
LOOP_NGRAM = 4
LOOP_PREFIX_TOKENS = (2, 24)  # a prompt's length: a name, a line of verse
LOOP_NEW_TOKENS = 96


def repeated_ngram_mask(tokens: list[int], start: int, words: set[int], n: int = LOOP_NGRAM) -> list[bool]:
    """For each position: is it a word inside an n-gram (ending at or after `start`) seen earlier?

        tokens  a b c a b c a        n = 3, start = 3, every token a word
        mask    . . . x x x x        "a b c", "b c a" and "c a b" each repeat
    """
    mask, seen = [False] * len(tokens), set()
    for end in range(n, len(tokens) + 1):
        gram = tuple(tokens[end - n : end])
        if end > start and gram in seen:
            for i in range(max(start, end - n), end):
                mask[i] = tokens[i] in words
        seen.add(gram)
    return mask


@torch.no_grad()
def greedy_continuations(model: LlamaForCausalLM, windows: torch.Tensor, tokenizer: PreTrainedTokenizerFast,
                         words: set[int], generator: torch.Generator
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each window's first few tokens continued greedily: the text, its repeated words and the
    positions written up to EOS, each [batch, prefix + LOOP_NEW_TOKENS]."""
    prefix_len = int(torch.randint(*LOOP_PREFIX_TOKENS, (1,), generator=generator))
    prefixes = windows[:, :prefix_len]
    model.eval()
    text = model.generate(prefixes, max_new_tokens=LOOP_NEW_TOKENS, do_sample=False,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                          attention_mask=torch.ones_like(prefixes))
    model.train()
    repeated, written = [], []
    for row in text.tolist():
        eos = tokenizer.eos_token_id
        length = row.index(eos, prefix_len) + 1 if eos in row[prefix_len:] else len(row)
        pad = [False] * (len(row) - length)
        repeated.append(repeated_ngram_mask(row[:length], prefix_len, words) + pad)
        written.append([False] * prefix_len + [True] * (length - prefix_len) + pad)
    return text, torch.tensor(repeated, device=text.device), torch.tensor(written, device=text.device)


def loop_correction_loss(model: LlamaForCausalLM, teacher: LlamaForCausalLM, text: torch.Tensor,
                         repeated: torch.Tensor, written: torch.Tensor, eos_id: int, weight: float,
                         teach_eos: bool = True) -> torch.Tensor:
    """Distillation on the model's own greedy text: the teacher's distribution at every written
    position, without the repeated word where one repeats (that position counts `weight` times).
    EOS keeps the teacher's share: the repeated word's goes to other words, so the model learns
    to say something new, not to stop sooner everywhere. With `teach_eos=False` EOS is left out of
    the target and of the model's softmax: the pass teaches words only, and where to stop is
    learned from the documents alone (the teacher's share would keep an early stop the
    documents no longer show)."""
    next_tokens, repeated, written = text[:, 1:], repeated[:, 1:], written[:, 1:]
    with torch.no_grad():
        target = torch.softmax(teacher(input_ids=text).logits[:, :-1].float(), dim=-1)
        eos_share = target[..., eos_id].clone() if teach_eos else torch.zeros_like(target[..., eos_id])
        target[repeated] = target[repeated].scatter(-1, next_tokens[repeated][:, None], 0.0)
        target[..., eos_id] = 0.0
        target *= ((1.0 - eos_share) / target.sum(dim=-1))[..., None]
        target[..., eos_id] = eos_share
        weights = written.float() * (1.0 + (weight - 1.0) * repeated.float())
    logits = model(input_ids=text).logits[:, :-1].float()
    if not teach_eos:  # a softmax over the other tokens: this pass never moves EOS
        logits = logits.index_fill(-1, torch.tensor([eos_id], device=logits.device), -1e4)
    log_q = torch.log_softmax(logits, dim=-1)
    return (-(target * log_q).sum(dim=-1) * weights).sum() / weights.sum().clamp(min=1.0)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay from lr to min_lr at the last step."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: LlamaForCausalLM, args: argparse.Namespace) -> torch.optim.AdamW:
    # Decay matrices (and the tied embedding), not the RMSNorm gains.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = args.device.startswith("cuda")
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=fused)


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int, device: str,
             autocast) -> float:
    """Mean next-token loss over all windows (all the same length)."""
    model.eval()
    losses = []
    for chunk in windows.split(batch_size):
        chunk = chunk.to(device)
        with autocast():
            losses.append(model(input_ids=chunk, labels=chunk).loss.float().item())
    model.train()
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------- training

def train(args: argparse.Namespace) -> dict:
    t_start = time.time()
    torch.manual_seed(args.seed)
    text = load_corpus(args.corpus, args.download)
    train_speeches, val_speeches = split_corpus(split_speeches(text))
    tokenizer, model = load_or_build(args, train_speeches)
    train_tokens = encode_documents(tokenizer, speech_documents(train_speeches, args.forms, args.seed,
                                                                args.form_weights, args.min_spoken_lines))
    val_tokens = encode_documents(tokenizer, speech_documents(val_speeches, args.forms, args.seed + 1,
                                                              args.form_weights, args.min_spoken_lines))
    # The held-out loss per layout, before and after, shows what the run kept of the start's quality.
    val_by_form = {form: encode_documents(tokenizer, [speech_document(s, form) for s in val_speeches])
                   for form in PROMPT_FORMS}
    bos_id = tokenizer.bos_token_id
    words = {i for i in range(len(tokenizer)) if any(c.isalpha() for c in tokenizer.decode([i]))}
    print(f"corpus: {len(text):,} chars, {len(train_speeches):,} + {len(val_speeches):,} speeches -> "
          f"train {len(train_tokens):,} tokens, val {len(val_tokens):,} tokens, vocab {len(tokenizer)}",
          flush=True)

    model = model.to(args.device)
    num_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    print(f"model: {num_params:,} parameters", flush=True)
    hooks = add_residual_dropout(model, args.dropout)
    optimizer = make_optimizer(model, args)
    teacher = None
    if args.distill_from is not None or args.self_distill:
        source = args.distill_from or args.init_from
        teacher = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).to(args.device).eval()
    on_gpu = args.device.startswith("cuda")
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu
                else contextlib.nullcontext)

    generator = torch.Generator().manual_seed(args.seed)
    val_windows = fixed_windows(val_tokens, args.block_size, bos_id, args.max_eval_windows)
    # Same number of train windows, evaluated the same way, so the two losses compare.
    train_eval_windows = sample_batch(train_tokens, len(val_windows), args.block_size, bos_id,
                                      torch.Generator().manual_seed(args.seed + 1))
    form_windows = {form: fixed_windows(tokens, args.block_size, bos_id, args.max_eval_windows)
                    for form, tokens in val_by_form.items()}
    def loss_by_form() -> dict:
        return {form: round(evaluate(model, w, args.batch_size, args.device, autocast), 4)
                for form, w in form_windows.items()}
    val_loss_by_form_at_start = loss_by_form()
    history, best = [], {"val_loss": float("inf"), "step": 0, "train_loss": float("nan")}
    best_state = None
    tokens_per_step = args.batch_size * args.block_size
    t_train, step, repeated_share = time.time(), 0, float("nan")
    model.train()
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1, args)
        batch = sample_batch(train_tokens, args.batch_size, args.block_size, bos_id, generator)
        batch = batch.to(args.device, non_blocking=True)
        with autocast():
            if teacher is None:
                loss = model(input_ids=batch, labels=batch).loss
            elif args.self_distill:
                loss = self_distillation_loss(model, teacher, batch, bos_id, tokenizer.eos_token_id,
                                              args.correction_weight)
            else:
                loss = distillation_loss(model, teacher, batch)
        if args.loop_correction_every and step % args.loop_correction_every == 0:
            text, repeated, written = greedy_continuations(model, batch, tokenizer, words, generator)
            with autocast():
                loss = loss + loop_correction_loss(model, teacher, text, repeated, written,
                                                    tokenizer.eos_token_id, args.loop_weight,
                                                    teach_eos=not args.loop_without_eos)
            repeated_share = repeated.sum().item() / max(1, written.sum().item())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()

        if step % args.log_interval == 0 or step == 1:
            elapsed = time.time() - t_train
            print(f"step {step:5d} | loss {loss.item():.4f} | lr {lr_at(step - 1, args):.2e} | "
                  f"{step * tokens_per_step / elapsed:,.0f} tok/s"
                  + (f" | repeated {repeated_share:.3f}" if args.loop_correction_every else ""), flush=True)
        out_of_time = args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes
        if step % args.eval_interval == 0 or step == args.steps or out_of_time:
            val_loss = evaluate(model, val_windows, args.batch_size, args.device, autocast)
            train_loss = evaluate(model, train_eval_windows, args.batch_size, args.device, autocast)
            history.append({"step": step, "train_loss": train_loss, "val_loss": val_loss})
            print(f"eval step {step:5d} | train {train_loss:.4f} | val {val_loss:.4f}", flush=True)
            if val_loss < best["val_loss"] or args.select == "last":
                best = {"val_loss": val_loss, "step": step, "train_loss": train_loss}
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        if out_of_time:
            print(f"stopping at step {step}: --max-minutes {args.max_minutes} reached", flush=True)
            break
    train_seconds = time.time() - t_train

    for h in hooks:
        h.remove()
    model.load_state_dict(best_state)
    val_loss_by_form_at_best = loss_by_form()
    model = model.to("cpu", torch.float32).eval()
    save(model, tokenizer, args)
    summary = {
        "parameters": num_params,
        "steps": step,
        "best_step": best["step"],
        "tokens_seen": step * tokens_per_step,
        "train_tokens": len(train_tokens),
        "val_tokens": len(val_tokens),
        "best_val_loss": round(best["val_loss"], 4),
        "train_loss_at_best": round(best["train_loss"], 4),
        "final_val_loss": round(history[-1]["val_loss"], 4),
        "val_loss_by_form_at_start": val_loss_by_form_at_start,
        "val_loss_by_form_at_best": val_loss_by_form_at_best,
        "final_train_loss": round(history[-1]["train_loss"], 4),
        "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "tokens_per_second": round(step * tokens_per_step / train_seconds),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "history": history,
    }
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    print(greedy_sample(model, tokenizer, "ROMEO:"), flush=True)
    return summary


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": args.max_shard_size} if args.max_shard_size else {}
    model.save_pretrained(args.out, **kwargs)  # float32, safetensors
    tokenizer.save_pretrained(args.out)


@torch.no_grad()
def greedy_sample(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str,
                  max_new_tokens: int = 60) -> str:
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    summary = train(parse_args(argv))
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))


if __name__ == "__main__":
    main()
