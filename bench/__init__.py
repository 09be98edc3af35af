"""Speed measured against peers: each script runs ours and a peer on the same work in one run and
prints both and the ratio (`python -m bench.<name>`); common.py holds what they share."""
