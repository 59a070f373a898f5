"""The step: one batch's plan (a decision per op plus the decided layout's tensors), built once per
batch, and each op called through the plan's decision for it. Paged batches (plan.py) and extend
batches (prefill.py metadata, extend.py plan). Imports the contract, the registry and deciding."""
