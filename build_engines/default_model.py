"""The default model: a small Llama checkpoint built locally and deterministically.

No hub access: a byte-level BPE tokenizer is trained with the ``tokenizers``
library on :mod:`build_engines.corpus`, and a ``LlamaForCausalLM`` gets seeded
random weights, then (tiny size) a short seeded training run on the same corpus so
that it writes readable sentences and ends them with EOS, as a real model does, and
writes compact JSON and Hermes-style tool calls that end (what guided decoding needs:
a grammar keeps output valid, but only the model decides to close a string).
The same command on the same machine gives the same files, byte for byte.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from build_engines import corpus

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]

# The template adds BOS itself, so callers render it and then encode with
# add_special_tokens=False (no double BOS).
#
# Tools (``tools=`` of apply_chat_template, OpenAI shape) go Hermes/Qwen style into a
# system turn (the request's own system message first): <tools>, one compact JSON line
# per function, </tools> and one instruction line. An assistant message's tool_calls
# render as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> (arguments a JSON
# string, as OpenAI sends them, or a dict), the text XGrammar's qwen_3 structural tag
# constrains a call to; tool messages render as one user turn of <tool_response>s.
# Without tools, plain messages render as they always have. (transformers renders with
# trim_blocks: a newline right after a block tag is dropped, hence {{ '\\n' }} there.)
TOOLS_INSTRUCTION = "To use a tool, answer with a <tool_call> of its name and arguments."
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "<|system|>\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "<tools>\n"
    "{% for tool in tools %}"
    "{% set f = tool['function'] if tool['function'] is defined else tool %}"
    "{\"name\": {{ f['name'] | tojson }}"
    "{% if f['description'] %}, \"description\": {{ f['description'] | tojson }}{% endif %}"
    ", \"parameters\": {{ (f['parameters'] or {}) | tojson }}}\n"
    "{% endfor %}"
    "</tools>\n" + TOOLS_INSTRUCTION + "{{ eos_token }}\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|user|>\n"
    "{% else %}{{ '\\n' }}{% endif %}"
    "<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ eos_token }}\n{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|assistant|>\n{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ fn[\'name\'] | tojson }}, "arguments": '
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}"
    "{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "{{ eos_token }}\n"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    vocab_size: int  # target for the tokenizer trainer; the corpus may give fewer
    train_steps: int  # 0 keeps the random weights


SIZES = {
    # ~4M parameters (2,048-token vocabulary), trained for ~30 s on 2 cores: the default
    # and test model.
    "tiny": ModelSize(256, 688, 4, 4, 2, 512, 2048, train_steps=200),
    # ~30M parameters, random weights: the benchmark model (speed, not prose).
    "bench": ModelSize(512, 1536, 10, 8, 4, 2048, 2048, train_steps=0),
}

SEED = 0
CORPUS_DOCUMENTS = 30_000


def corpus_texts() -> list[str]:
    """The corpus as the model reads it: each plain text between BOS and EOS, each chat
    rendered by CHAT_TEMPLATE (the text a served chat request is, turn for turn)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    texts = []
    for doc in corpus.documents(CORPUS_DOCUMENTS, seed=SEED):
        if isinstance(doc, str):
            texts.append(f"{BOS}{doc}{EOS}")
        else:
            messages, tools = doc
            rendered, _ = render_jinja_template(
                [messages], tools=tools, chat_template=CHAT_TEMPLATE, bos_token=BOS, eos_token=EOS
            )
            texts.append(rendered[0])
    return texts


def train_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """Byte-level BPE (GPT-2 style) with BOS added by the post-processor."""
    import re

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer does not split special tokens out of its text: drop them.
    specials = re.compile("|".join(re.escape(t) for t in [PAD, BOS, EOS, *ROLE_TOKENS]))
    texts = corpus_texts() if texts is None else texts
    tok.train_from_iterator((specials.sub("\n", t) for t in texts), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=None,
    )


def build_model(size: ModelSize, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        max_position_embeddings=size.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        # A wider init than Llama's 0.02 gives peaked logits, so greedy decoding
        # is not decided by float rounding between near-equal scores.
        initializer_range=0.08,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def train(model, tokenizer, steps: int, on_step=None, texts: list[str] | None = None) -> None:
    """A short next-token training run on the corpus; seeded, single-machine deterministic."""
    import math

    import torch

    texts = corpus_texts() if texts is None else texts
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    data = torch.tensor([i for ids in encoded for i in ids])
    # 256 positions: most windows hold a whole tool conversation (listing, question,
    # call); 4 x 256 tokens a step cost what 16 x 64 did.
    seq_len, batch_size, peak_lr = 256, 4, 3e-3
    generator = torch.Generator().manual_seed(SEED)
    # Fixed thread count: float reductions, hence the weights, depend on it.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.0)
    model.train()
    try:
        for step in range(steps):
            starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
            batch = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
            warmup = min(1.0, (step + 1) / 20)
            for group in optimizer.param_groups:
                group["lr"] = peak_lr * warmup * 0.5 * (1 + math.cos(math.pi * step / steps))
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if on_step:
                on_step(step, loss.item())
    finally:
        torch.set_num_threads(threads)
        model.eval()


def write_default_model(out_dir: Path, size_name: str, reporter=None) -> Path:
    """Write tokenizer + weights + configs to ``out_dir`` (a plain HF checkpoint).

    ``reporter`` (optional) has ``stage(text)`` and ``steps(total)`` -> callable(step, loss).
    """
    size = SIZES[size_name]
    out_dir.mkdir(parents=True, exist_ok=True)
    stage = reporter.stage if reporter else (lambda _text: None)
    stage("generating the corpus")
    texts = corpus_texts()
    stage("training the BPE tokenizer")
    tokenizer = train_tokenizer(size.vocab_size, texts)
    stage(f"initialising the {size_name} Llama model")
    model = build_model(size, tokenizer)
    if size.train_steps:
        on_step = reporter.steps(size.train_steps) if reporter else None
        train(model, tokenizer, size.train_steps, on_step, texts)
    stage("saving the checkpoint")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def describe(size_name: str) -> dict:
    return {"size": size_name, "seed": SEED, **asdict(SIZES[size_name])}
