"""What the model packages (``drafters``, ``parcae``) and the decoding loop (``serve_eval``) share with
the training engine: a leaf that imports nothing else from the project (``tests/e2e/test_layers.py``).

    features  target features captured by hooks, the layer-id convention, the target's layers / norm
    lm        next-token inputs, labels, cross-entropy and held-out evaluation
    flops     matmul parameters and FLOPs per token (MFU)
    schema    ``Strict``, the base of every typed recipe section
    decoding  ``DecodingSection``: what the decoding loop is asked to do
"""
