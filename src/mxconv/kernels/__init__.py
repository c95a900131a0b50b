"""GPU kernels. Importing this package never requires triton or CUDA; check
``mxconv.kernels.mx_triton.triton_available()``."""
