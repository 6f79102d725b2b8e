# The two commands of the README. Each sets up what it needs by itself.
.PHONY: test bench

test:
	bash scripts/test.sh

bench:
	bash scripts/bench.sh
