"""instructor against sgrt in its TOOLS mode (the model fills a function call) and its
JSON_SCHEMA mode (response_format), with a nested Pydantic model.

    pip install instructor && sgrt serve &   python examples/frameworks/instructor_example.py
"""
from __future__ import annotations

import instructor
from _report import BASE_URL, MODEL, check
from openai import OpenAI
from pydantic import BaseModel


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    address: Address


def extract(mode: instructor.Mode) -> Person:
    client = instructor.from_openai(OpenAI(base_url=BASE_URL, api_key="unused"), mode=mode)
    return client.chat.completions.create(
        model=MODEL, response_model=Person, max_retries=0, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Ann lives in Oslo, Norway. Extract the person."}])


if __name__ == "__main__":
    check("structured (TOOLS)", lambda: extract(instructor.Mode.TOOLS))
    check("structured (JSON_SCHEMA)", lambda: extract(instructor.Mode.JSON_SCHEMA))
