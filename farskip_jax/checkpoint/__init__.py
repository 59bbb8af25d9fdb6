"""HF <-> NNX key mapping, HF directory loading, Orbax conversion and training checkpoints."""
