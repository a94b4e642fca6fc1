"""One module per op: public function -> torch.library op (fake + autograd) -> rl_kernels._C."""
