"""A sharded program's simulated step against the single-device model's: the loss, the logits (not
under pp, whose program returns the loss alone) and every gradient within 1e-5."""
from autoshard import autoshard
from autoshard.testing import grad_errors, max_rel


def assert_matches_one_device(prog, kw: dict, ref, ref_grads: dict, *, logits: bool = True) -> None:
    """`ref`: the model's output on `kw` (loss and logits), `ref_grads`: its gradients by name."""
    out = prog.simulate(**kw)
    assert max_rel(out.loss, ref.loss) <= 1e-5
    if logits:
        assert max_rel(out.logits, ref.logits) <= 1e-5
    out.loss.backward()
    errs = grad_errors(prog.full_grads(), ref_grads)
    assert max(errs.values()) <= 1e-5, max(errs.items(), key=lambda kv: kv[1])


def split_and_match(model, kw: dict, tp: int, pp: int):
    """The model at tp x pp (2 microbatches under pp), its step on `kw` matched against the model's
    own (before it is compiled); the program, for the test's checks of what it split."""
    ref = model(**kw)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    mesh = dict(pp=pp, microbatches=2) if pp > 1 else {}
    prog = autoshard(model, tp=tp, example_kwargs=kw, **mesh)
    assert_matches_one_device(prog, kw, ref, ref_grads, logits=pp == 1)
    return prog
