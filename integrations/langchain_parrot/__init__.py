"""LangChain integration of Parrot serve (placeholder while building)."""
from langchain_parrot.chat_models import ChatParrot
from langchain_parrot.llms import ParrotLLM
