"""To run: uv run main.py fit --config configs/amp.yaml   (see configs/ and README.md)."""

from modelwright.train.cli import cli_main

if __name__ == "__main__":
    raise SystemExit(cli_main())
