"""The contract between the transfer manager (`transfers/`) and the data-plane engines (`backends/`), below both:
what to move and what landed (`plan.py`), the seam every engine implements (`seam.py`), and the claims that keep
two writers out of one destination block (`blocklocks.py`). It imports neither of the floors above it."""
