"""Moondream 2 (vikhyatk/moondream2), natively: a SigLIP vision tower over overlapping
crops, a Phi text model, and region heads that write points and boxes as coordinates, not text.
Registered in models/registry.py (`moondream1`); the demo model shipped in the package is one."""
