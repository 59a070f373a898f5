"""Helpers several built-in backends share (the Triton and DeepGEMM backends both use them): the page
guard that checks a batch's page table once, the NaN-poisoning of rows a bad page or length touched, and
the Triton K gather of the extend step. Kept out of any one plugin so that no plugin imports another."""
