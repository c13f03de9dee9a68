"""What a person runs: the demo, the benchmarks, the GPU check, reference-model training.

Tools use the decoding core and the model families; nothing in the core or the families imports a
tool.
"""
