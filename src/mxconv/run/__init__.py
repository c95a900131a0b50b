"""One conversion run, driven by :class:`mxconv.run.conversion.Conversion` (open source, plan, plan
memory, prepare output, run, finalize): its typed options (``options``), what to read and write
(``plan``, ``linears``), the memory budget (``memory``, ``plan_costs``, ``machine``), one work item
on the device (``compute``, ``linear_compute``), the reader -> compute -> writer pipeline
(``pipeline``, timed by ``trace``) and what the output says about itself (``finalize``,
``linear_config``)."""
