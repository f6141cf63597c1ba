"""Device state of sequences, shared by the engine and the model families (neither owns it).

`models/` may not import `engine/`, and the engine must not import a family, so the state both
sides touch lives here: the state kinds a model declares (specs.py), the tensors that hold them
(tensors.py), the host-side accounting of blocks and state slots (blocks.py) and where each
sequence's tokens sit for layers with a recurrent state (spans.py). Only torch.
"""
