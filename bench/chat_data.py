"""Synthetic inputs for the data path's benchmarks (tokenise_speed, chat_template_check): the
byte-level BPE tokenizer of examples/chat_finetune.py (the same recipe; a test keeps the two
byte-identical), three chat templates, random conversations and text made from the shipped
corpus, and a tokenizer directory laid out as transformers' save_pretrained writes one. Never
tokenises a corpus and never times anything.

The templates: ChatML as Qwen2's instruct models write it; the same with the assistant's turn in
{% generation %} tags (what transformers' return_assistant_tokens_mask needs); and a Llama-3
style one (bos_token first, <|start_header_id|>role<|end_header_id|>, contents trimmed, turns
ended by <|eot_id|>) whose tokenizer adds <|begin_of_text|> in its post-processor as Llama 3's
does, so a tokenisation that forgets add_special_tokens=False shows up as a doubled BOS."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from dataflow.data.shipped import shipped_text_path

CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>")
VOCAB_SIZE = 480

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

QWEN3 = (  # Qwen3's rule in small: the replies after the last user turn show their reasoning
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

TEMPLATES = {"chatml": CHATML, "chatml-generation": CHATML_GENERATION, "llama3": LLAMA3,
             "qwen3": QWEN3}
"""name -> template; every name but 'llama3' uses the ChatML tokenizer."""

SYSTEM_PROMPTS = ("You are a careful assistant.", "Answer in as few words as you can.",
                  "You are Alice. Stay in the story.")


def train_tokenizer(specials=CHATML_SPECIALS, vocab_size: int = VOCAB_SIZE, *,
                    bos_post_processor: str | None = None):
    """examples/chat_finetune.py's byte-level BPE (GPT-2's pre-tokeniser) trained on the
    shipped text; with bos_post_processor, a post-processor that puts that token first when
    special tokens are added (Llama 3's TemplateProcessing after ByteLevel)."""
    from tokenizers import processors

    tok, trainer = _byte_level_bpe(vocab_size, specials)
    tok.train([str(shipped_text_path())], trainer)
    if bos_post_processor is not None:
        bos = (bos_post_processor, tok.token_to_id(bos_post_processor))
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B",
                                          special_tokens=[bos])])
    return tok


def _byte_level_bpe(vocab_size: int, specials, **trainer_options):
    """An untrained byte-level BPE (GPT-2's pre-tokeniser, decoder and post-processor) and its
    trainer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, **trainer_options)
    return tok, trainer


def train_large_tokenizer(vocab_size: int = 150_000, seed: int = 0):
    """A byte-level BPE of `vocab_size` ids trained on random lowercase words (the shipped text
    has too few distinct words for more than about 7,000): a tokenizer.json of about 10 MB at
    150,000 ids, as Qwen's and Llama 3's are, so loading and encoding cost what a real model's
    do. About 15 s to train on one core."""
    import tempfile

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 10)))
             for _ in range(2 * vocab_size)]
    tok, trainer = _byte_level_bpe(vocab_size, CHATML_SPECIALS, min_frequency=2)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "words.txt"
        with open(text, "w") as f:
            for _ in range(4):
                rng.shuffle(words)
                f.write(" ".join(words) + "\n")
        tok.train([str(text)], trainer)
    return tok


def write_tokenizer_dir(path: Path, template_name: str, *, large: bool = False) -> Path:
    """A tokenizer directory for TEMPLATES[template_name]: tokenizer.json and
    tokenizer_config.json (tokenizer_class PreTrainedTokenizerFast, the named special tokens and
    the chat template), as AutoTokenizer.from_pretrained and dataflow's load_tokenizer read it.
    large: the ChatML tokenizer of train_large_tokenizer instead of the example's."""
    path.mkdir(parents=True, exist_ok=True)
    if template_name == "llama3":
        tok = train_tokenizer(LLAMA3_SPECIALS, bos_post_processor="<|begin_of_text|>")
        names = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                 "pad_token": "<|end_of_text|>"}
    else:
        tok = train_large_tokenizer() if large else train_tokenizer()
        names = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "model_max_length": 4096,
              "chat_template": TEMPLATES[template_name]}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return path


def corpus_words() -> list[str]:
    """The shipped text's words, in order (repeats kept: common words stay common)."""
    return re.findall(r"[A-Za-z’']+|[0-9]+", shipped_text_path().read_text(encoding="utf-8"))


def random_conversation(rng: random.Random, words: list[str], *, max_turns: int = 4) -> list:
    """An optional system prompt, then 1..max_turns user and assistant turns of random phrases
    from `words` (some with a newline, a number, a leading or trailing space or curly quotes)."""

    def phrase():
        n = rng.randint(1, 24)
        start = rng.randrange(len(words) - n)
        text = " ".join(words[start:start + n])
        roll = rng.random()
        if roll < 0.1:
            text += f"\n{rng.randint(0, 9999)}"
        elif roll < 0.15:
            text = f" {text} "
        elif roll < 0.2:
            text = f"“{text}”?"
        return text

    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.randint(1, max_turns)):
        messages += [{"role": "user", "content": phrase()},
                     {"role": "assistant", "content": phrase()}]
    return messages


def varied_text(rng: random.Random, n_bytes: int) -> str:
    """About n_bytes of UTF-8 text: the shipped text's paragraphs, shuffled each time round, one
    word in twenty replaced by another word of the text (so no two copies are the same)."""
    paragraphs = [p for p in shipped_text_path().read_text(encoding="utf-8").split("\n\n")
                  if p.strip()]
    words = corpus_words()
    out, size = [], 0
    while size < n_bytes:
        for p in rng.sample(paragraphs, len(paragraphs)):
            tokens = p.split(" ")
            for _ in range(len(tokens) // 20):
                tokens[rng.randrange(len(tokens))] = rng.choice(words)
            p = " ".join(tokens) + "\n\n"
            out.append(p)
            size += len(p.encode("utf-8"))
            if size >= n_bytes:
                break
    return "".join(out)
