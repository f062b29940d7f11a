"""Data: the conversations a drafter learns from, and the target's own answers to them.

`hstap prepare` (`prepare.py`, its config in `prepare_config.py`) renders conversations with the chat template into
input_ids + assistant-only loss_mask and picks the draft vocabulary (`hstap.artifacts.vocab_map`); `chat.py` is the
rendering itself (text, ids, the loss-mask rule) that prepare, generate and eval share, and `reasoning.py` what
reasoning models add (an answer's thinking, the chat-template kwargs that switch it). `conversations.py` reads the input
formats with file:line errors; `hstap data` (`sources.py`) writes the field's datasets from their pip packages (ShareGPT
salvaged, MT-bench prompts). `fits.py` says whether a prepared set fits a target (its tokenizer and chat template:
capture, train and eval check it). `hstap generate` (`generate.py`, its config in `generate_config.py`, its answers file
in `answers.py`, what it prints while it runs in `progress.py`) replaces the assistant turns with the target's answers,
decoded in-process (`continuous.py`: continuous batching over KV rows kept across a conversation's turns; `decode.py`:
stop tokens, sampling, lockstep batches) or by any OpenAI-compatible server (`openai_client.py`); `serve.py` is a
minimal such server over the embedded engine. `generate --capture` is the capture stage's composition of generate
(`hstap.capture.tap`). `prompts.py` reads the prompts a decoder is measured or served on (eval's, the serve loop's
requests).
"""
