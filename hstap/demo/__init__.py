"""The demo: `stage.py` is `hstap demo` (a toy target, checked, then generate -> prepare -> capture -> train -> eval,
one table), `config.py` its config; `toy.py` builds the toy targets it trains on the spot (a BPE tokenizer and a small
Llama trained on Python's own documentation) and the random test models of every family hstap supports; `quantize.py`
writes quantized copies of a target in the formats they ship in (compressed-tensors INT4, DeepSeek-V3's block FP8).
"""
