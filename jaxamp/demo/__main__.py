"""``python -m jaxamp.demo``: see ``python -m jaxamp.demo --help``."""

if __name__ == "__main__":
  from jaxamp.demo.cli import main

  raise SystemExit(main())
