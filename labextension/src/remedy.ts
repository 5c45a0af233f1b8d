/**
 * Who holds the ports of a refused restore, from the server's error: the notebook's own
 * kernel, another kernel of the server (named by its notebook), or something else.
 */
import type { IJobError } from './api';
import { untranslated } from './translation';

export type PortsHolder =
  | { kind: 'this-kernel' }
  | { kind: 'other-kernel'; kernelId: string; path: string | null; owner: string }
  | { kind: 'outside' };

/** Null unless the error is a refusal for taken ports (error code ports_in_use). */
export function portsHolder(
  error: IJobError | null,
  ownKernelId: string | null,
  trans = untranslated
): PortsHolder | null {
  if (error?.code !== 'ports_in_use') {
    return null;
  }
  const holder = error.details?.holder_kernel_id ?? null;
  if (!holder) {
    return { kind: 'outside' };
  }
  if (holder === ownKernelId) {
    return { kind: 'this-kernel' };
  }
  const path = error.details?.holder_notebook_path ?? null;
  const owner = path ? path.split('/').pop() || path : trans.__('kernel %1', holder);
  return { kind: 'other-kernel', kernelId: holder, path, owner };
}
