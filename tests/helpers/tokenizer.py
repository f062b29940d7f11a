"""Tokenizer helpers shared by the prepare and model-directory tests: copies of the toy tokenizer with other chat
templates and special tokens."""

from __future__ import annotations

from hstap.artifacts.model_dir import load_tokenizer

CHATML = (  # Qwen2.5: a default system prompt when the conversation has none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def variant_tokenizer(tiny_tokenizer, tmp_path_factory, name, template, specials=(), bos=None):
    """A copy of the toy tokenizer with extra special tokens and another chat template, saved and reloaded."""
    tok = load_tokenizer(tiny_tokenizer[1])
    tok.add_tokens(list(specials), special_tokens=True)
    if bos:
        tok.bos_token = bos
    tok.chat_template = template
    d = tmp_path_factory.mktemp(name)
    tok.save_pretrained(str(d))
    return load_tokenizer(d), d
