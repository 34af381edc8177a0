"""Training and evaluation code, off the serving path: the demo's synthetic world, its two-stage trainer, the
builder of its config/tokenizer/processor, the held-out eval, EAGLE chat data and `vlserve train-eagle`.

The serving packages never import this one; it may import any of them (and vlserve.testing's fixtures).
"""
