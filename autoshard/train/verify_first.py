"""`autoshard train --verify`: the split certified before the first step (autoshard/verify/)."""
from __future__ import annotations


from autoshard.train.model_source import ModelSource
from autoshard.train.options import TrainError
from autoshard.verify.source import VerifyError, model_to_verify
from autoshard.verify.run import verify_model
from autoshard.world import current

__all__ = ["verify_first"]


def verify_first(source: ModelSource, prog, rank: int) -> None:
    """--verify: rank 0 certifies the compiled split (autoshard/verify/) and prints the certificate;
    every rank stops with its verdict if it failed."""
    verdict = [None]
    if rank == 0:
        try:
            cfg = source.config if source.kind in ("config", "folder") else None
            model, twin = model_to_verify(cfg, source.model, prog.split(), given=f"--model {source.kind}")
            cert = verify_model(model, prog.split(), twin=twin)
            print(cert.render(), flush=True)
            verdict = [None if cert.passed else cert.verdict()]
        except VerifyError as e:
            verdict = [str(e)]
    verdict = current().broadcast_object(verdict, src=0)
    if verdict[0] is not None:
        raise TrainError(f"--verify: {verdict[0]}; no step was taken")
