"""The embedded engine (`hstap capture --engine hf`): `forward.py` is the batched forward (length-packed, right-padded
prefills, the padding rows dropped on the device), `runner.py` the pipeline that keeps the GPU busy while a writer
thread stores its states (asynchronous device-to-host copies into pinned buffers, the writer queue's back-pressure),
`driver.py` the stage: this rank's share of the prepared set through the runner into the store."""
