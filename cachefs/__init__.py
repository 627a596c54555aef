"""cachefs: an order-aware, read-only FUSE cache for deep-learning data sets.

Importing the package is cheap and never imports pyfuse3 or torch: the order-file API
(`cachefs.order`) is usable by trainers on machines without FUSE.
"""

__version__ = "0.1.0"
