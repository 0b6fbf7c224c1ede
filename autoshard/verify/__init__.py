"""`autoshard verify`: a certificate that a sharded program equals the single-device model, before
GPU hours are spent on it (see README.md, "Verify")."""
from autoshard.verify.certificate import Certificate, Item
from autoshard.verify.run import verify_model, verify_program

__all__ = ["Certificate", "Item", "verify_model", "verify_program"]
