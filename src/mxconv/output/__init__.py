"""Writing an output: shards streamed under temporary names and renamed when complete (``writer``),
the output directory's lifecycle (``directory``: checks, free space, staging for --overwrite,
cleanup, atomic small files), the manifest ``mxconv.json`` (``manifest``) and the engine-facing
``quant_config`` inside it (``engine_quant_config``)."""
