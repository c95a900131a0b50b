"""The canonical expert stack, its sizes and TP split: the vocabulary every layer above speaks.

``stack`` (:class:`CanonicalExperts`, :class:`LayoutSizes`, :class:`InputScales`, the row orders and
weight formats), ``tensors`` (:class:`TensorSpec`, the kernel tensors' names), ``padding`` (a stack
zero-padded and cut back, the padding checked), ``tp`` (the intermediate axis split by rank) and
``kernel_settings`` (the caller's :class:`KernelChoice` and :class:`KernelLocations`). Families read
into it, layouts lay it out, output plans and writes its specs, run slices and converts it; it
imports only :mod:`mxconv.errors` and :mod:`mxconv.source.st_format`.
"""
