"""The types every layer shares: a request and its state (``request``), its sampling parameters
(``sampling_params``), what the engine returns (``outputs``), the errors that end one request or
the engine (``errors``), what the scheduler hands the runner (``scheduler_output``) and the batch
the model runs (``forward_batch``). They import nothing else of deepbatch."""
