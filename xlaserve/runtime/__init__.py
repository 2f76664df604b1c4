"""Device runtime: the PJRT seam (``pjrt``) and the weight cache."""
