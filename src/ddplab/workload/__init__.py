"""What is trained: the data, the model, the loss and the optimizer, ddplab's own or the user's.

    data        datasets (synthetic, CIFAR-10, ImageFolder, the user's) and their samplers/loaders
    textdata    token streams for the language models
    gpt         the small GPT of the lm-* experiments
    models      the model registry (names -> constructors) and building one
    losses      the loss by name or import path
    optim       optimizer and learning-rate schedule
    userparts   a user's own model, dataset, loss and metrics by import path (module:attr)

Nothing here knows about ranks or process groups: training/ wraps and spreads what is built here.
"""
