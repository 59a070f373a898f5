"""The step: the builders of one batch's plan (a decision per op plus the decided layout's tensors), built
once per batch. Paged batches (paged_plan.py) and extend batches (extend_batch.py for the ragged
metadata, with its CPU path ragged_on_host.py and its one-launch GPU kernel ragged_metadata_kernel.py;
extend_plan.py for the plan). The plan types themselves are the contract's (dispatch/contract/plan.py,
extend_batch.py, extend_plan.py), since a backend reads them. Each op is called through the plan's
decision by its file in dispatch/contract/ops/. Imports the contract, the registry and deciding."""
