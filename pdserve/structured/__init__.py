"""Structured output and tool calls on llguidance (``pip install 'pdserve[structured]'``).

``grammars``: request grammars (JSON schema, regex, choice, Lark / GBNF) turned into
llguidance grammars, checked, compiled once per text (LRU) and copied into one matcher per
request; ``tools``: the tool-call grammars and the parsers of model text into tool calls.
llguidance is imported only when a request asks for a grammar.
"""
