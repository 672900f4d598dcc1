"""Tool calling for the text service: the formats chat templates speak (formats.py) and reading calls and reasoning
back out of a reply (parsers.py). Torch-free; xgrammar is imported only where a grammar is built."""
