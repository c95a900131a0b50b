"""Reading a checkpoint: a local directory or a Hugging Face repo id (``checkpoint``), every
safetensors header checked before a byte is used (``st_format``), streamed reads and write-back
hints (``diskio``), and the NaN/Inf scan of bytes copied as they are (``copy_check``). Imports
nothing of mxconv but ``errors``."""
