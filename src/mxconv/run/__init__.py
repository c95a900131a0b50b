"""One conversion run: what to read and write (``plan``), the memory budget (``memory``), one work
item on the device (``compute``, ``linears`` for --targets linear), the reader -> compute -> writer
pipeline (``pipeline``) and the run itself, from plan to committed output (``conversion``)."""
