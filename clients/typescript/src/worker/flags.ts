/**
 * The worker's small concurrency tools: {@link Flag} (an `asyncio.Event`), {@link waitFor}
 * (wait for the first of some flags or a timeout) and {@link Backoff} (jittered retry delays).
 */

/** A flag that can be awaited: `set()` wakes every waiter until `clear()`. */
export class Flag {
  #set = false;
  #waiters: Array<() => void> = [];

  get isSet(): boolean {
    return this.#set;
  }

  set(): void {
    if (this.#set) return;
    this.#set = true;
    const waiters = this.#waiters;
    this.#waiters = [];
    for (const wake of waiters) wake();
  }

  clear(): void {
    this.#set = false;
  }

  /** Resolves once the flag is set (at once when it is). */
  wait(): Promise<void> {
    if (this.#set) return Promise.resolve();
    return new Promise((resolve) => this.#waiters.push(resolve));
  }

  /** Calls `wake` once when set; returns a function that cancels the subscription. */
  subscribe(wake: () => void): () => void {
    if (this.#set) {
      wake();
      return () => {};
    }
    this.#waiters.push(wake);
    return () => {
      const i = this.#waiters.indexOf(wake);
      if (i >= 0) this.#waiters.splice(i, 1);
    };
  }
}

/**
 * Waits until one of `flags` is set or `ms` milliseconds pass (`null`: no limit); resolves
 * to whether a flag was set.
 */
export function waitFor(ms: number | null, ...flags: Flag[]): Promise<boolean> {
  if (flags.some((f) => f.isSet)) return Promise.resolve(true);
  return new Promise((resolve) => {
    const unsubscribes: Array<() => void> = [];
    let timer: NodeJS.Timeout | undefined;
    const finish = (flagged: boolean) => {
      if (timer !== undefined) clearTimeout(timer);
      for (const unsubscribe of unsubscribes) unsubscribe();
      resolve(flagged);
    };
    for (const flag of flags) unsubscribes.push(flag.subscribe(() => finish(true)));
    if (ms !== null) timer = setTimeout(() => finish(false), Math.max(ms, 0));
  });
}

/** Jittered exponential delays in milliseconds: `base`, `2 * base`, ... up to `cap`. */
export class Backoff {
  #tries = 0;

  constructor(
    private readonly base: number,
    private readonly cap: number,
  ) {}

  /** The next delay (between half and all of the current step). */
  next(): number {
    const step = Math.min(this.cap, this.base * 2 ** Math.min(this.#tries, 30));
    this.#tries += 1;
    return step / 2 + Math.random() * (step / 2);
  }

  /** Starts again from `base`. */
  reset(): void {
    this.#tries = 0;
  }
}
