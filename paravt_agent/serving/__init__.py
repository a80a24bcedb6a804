"""Serving the agent: the OpenAI-compatible API (`paravt api`), LangGraph Server's graph, the SGLang launcher."""
