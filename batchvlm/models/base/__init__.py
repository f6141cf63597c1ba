"""What every family builds on: the contract (contract.py), the errors, the host and device bases
with the one `load()` and the classify wrapper, shared layers, and the machinery families share
(hub loading, decoding, json grammars, grounding parsers, columns, pinned uploads, pixel tables).
The long form: docs/adding-a-family.md."""
