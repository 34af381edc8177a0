"""The demo models' training and evaluation (run from a checkout as `python -m training.<module>`): the two-stage
trainer, the builder of its config/tokenizer/processor, the held-out eval, EAGLE chat data and the EAGLE trainer.

vlserve never imports this package; it imports vlserve (the demo worlds live in vlserve.demo).
"""
