"""The engines' own MoE kernels, run on the bytes mxconv writes.

* :mod:`mxconv.engines.runner` resolves the :class:`~mxconv.engines.runner.EngineRunner` a backend
  layout points to (``Layout.engine_runner``), says why a kernel cannot run here
  (:func:`~mxconv.engines.runner.kernel_unavailable`) and holds :data:`KERNEL_THRESHOLDS`, the bound
  for kernel output vs the fp32 reference on the same MXFP4 bytes;
* :mod:`mxconv.engines.discover` finds the installed kernels and checks the GPU;
* one module per engine holds its runner and expert objects (e.g. :mod:`mxconv.engines.triton_moe`,
  :mod:`mxconv.engines.marlin_moe`);
* :mod:`mxconv.engines.loader` reads one layer of an output into the runner's objects and runs it
  (:func:`~mxconv.engines.loader.run_kernel_layer`, for ``mxconv verify --kernel``).

Nothing here imports torch, triton or vLLM until a function runs; the package itself imports nothing.
"""
