"""`python -m expertcache ...` runs the CLI (the same as the `expertcache` command)."""

from expertcache.cli import main

if __name__ == "__main__":
    main()
