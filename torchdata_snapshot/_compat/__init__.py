"""The private fields of torch's and torchdata's classes this package reads, one module per class
(or family of classes) it reads them of: a release that moves one breaks one line here, and the
tests, which run on every supported torchdata, say which. In torchdata's tree each module is code
in the module of the class it reads.

Names a torchdata module defines for its own package (``_find_replicable_branches``, the
dispatching placeholder, the graph's serialization wrapper) are imported from it where used.

Checked against torch 2.13 and torchdata 0.7.1, 0.8.0 and 0.9.0."""
