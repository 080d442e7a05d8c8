"""Wrapper names (DistributedModelParallel's `_dmp_wrapped_module.`, DDP's `module.`) are known in one place."""

import torch

from lightning_rec.fqn import canonical_fqn, is_wrapper_child


def test_canonical_fqn_strips_one_leading_wrapper_prefix():
    assert canonical_fqn("_dmp_wrapped_module.module.ebc.t_a") == "ebc.t_a"
    assert canonical_fqn("_dmp_wrapped_module.ebc.t_a") == "ebc.t_a"
    assert canonical_fqn("module.ebc.t_a") == "ebc.t_a"
    assert canonical_fqn("module.module.t") == "module.t"  # the model's own child named `module` stays
    assert canonical_fqn("ebc.module.t") == "ebc.module.t"


def test_only_ddps_module_child_is_a_wrapper():
    plain = torch.nn.Module()
    assert is_wrapper_child(plain, "_dmp_wrapped_module")
    assert not is_wrapper_child(plain, "module")  # a user's model may name a child `module`
