"""The step: one batch's plan (a decision per op plus the decided layout's tensors), built once per
batch. Paged batches (paged_plan.py) and extend batches (extend_batch.py and its host path
ragged_on_host.py for the metadata, extend_plan.py for the plan). Each op is called through the plan's
decision by its file in dispatch/contract/ops/. Imports the contract, the registry and deciding."""
