"""Writing an output: shards streamed under temporary names and renamed when complete (``writer``),
the output directory's lifecycle (``directory``: checks, free space, staging for --overwrite,
cleanup), one writer per OUTPUT (``lock``), what an output owns and so may remove (``ownership``),
files created new and never written through a link (``files``), the manifest ``mxconv.json``
(``manifest``) and the engine-facing ``quant_config`` inside it (``engine_quant_config``)."""
