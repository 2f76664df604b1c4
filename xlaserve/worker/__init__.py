"""One worker: Trio actors around one device."""
