"""severity_grader's model.py: CORAL ordinal logits -> a grade and its label.

The model emits one logit per grade threshold. The grade is the number of consecutive leading
logits above zero, stopping at the first that is not: an early exit that is awkward in a static
XLA graph and a plain loop here, right next to the model.
"""
import numpy as np

from xlaserve import NamedTensor, register_model

LABELS = (b"none", b"trace", b"minimal", b"mild", b"moderate", b"marked", b"severe", b"grave", b"extreme",
          b"critical")


def coral_grade(logits: np.ndarray) -> np.ndarray:
    """Leading positive logits of each row of ``logits`` [B, Z], as int64 [B, 1]."""
    grade = np.zeros((logits.shape[0], 1), dtype=np.int64)
    for b, row in enumerate(logits):
        n = 0
        for value in row:
            if value > 0:
                n += 1
            else:
                break
        grade[b, 0] = n
    return grade


def postprocess(outputs):
    logits = outputs[0].data                   # OUTPUT__0: float32 [B, 9], row-major
    grade = coral_grade(logits)
    label = np.array([[LABELS[g]] for g in grade[:, 0]], dtype=object)
    return [NamedTensor("grade", grade), NamedTensor("label", label)]


register_model("severity_grader", postprocess=postprocess)
