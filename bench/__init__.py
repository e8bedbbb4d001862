"""stallwatch's benchmark suite (issue 7): `python -m bench --help`, and bench/README.md."""
