"""The operator's console in the browser (DESIGN.md §14): server-rendered pages on aiohttp,
templates on Jinja2 with autoescaping, every change through smtpguard/desk.py."""
